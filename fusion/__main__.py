import sys

from fusion.cli.main import main

sys.exit(main())
