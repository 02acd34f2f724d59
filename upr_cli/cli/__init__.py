"""The Typer command-line interface: thin commands over `upr_cli.jobs`."""
