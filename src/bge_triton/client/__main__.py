"""Entry point of `python -m bge_triton.client`."""
import sys

from bge_triton.client.cli import main

sys.exit(main())
