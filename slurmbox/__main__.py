import sys

from slurmbox.box import main

sys.exit(main())
