import sys

from graphrt.cli import main

sys.exit(main())
