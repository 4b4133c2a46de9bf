"""`python -m sharpclip ...` (and `torchrun -m sharpclip ...`) run the command-line interface."""

from sharpclip.cli import main

raise SystemExit(main())
