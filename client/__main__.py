"""Entry point of `python -m client`."""
import sys

from client.cli import main

sys.exit(main())
