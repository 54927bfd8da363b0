"""CLI subcommands. Each module here defines ``register(subparsers)``; ``pdserve.app.cli`` finds them."""
