"""The top layer: command line, launchers, role wiring, load generator. Imports every layer below."""
