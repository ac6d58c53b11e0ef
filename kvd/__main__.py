"""`python -m kvd`: the `kvd` command (kvd.cli), for the daemon process and its small clients."""
from .cli import main

raise SystemExit(main())
