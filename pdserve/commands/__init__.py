"""CLI subcommands. Each module here defines ``register(subparsers)``; ``pdserve.cli`` finds them."""
