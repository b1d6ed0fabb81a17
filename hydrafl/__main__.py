"""`python -m hydrafl` is the `hydrafl` command."""

from hydrafl.cli import main

main()
