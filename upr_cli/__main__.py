"""`python -m upr_cli` runs the `upr` command."""

from upr_cli.cli.app import main

if __name__ == "__main__":
    main()
