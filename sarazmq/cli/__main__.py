"""`python -m sarazmq.cli`."""

from sarazmq.cli import main

main()
