"""The command lines of the tools, one module per command."""
