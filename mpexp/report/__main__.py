import sys

from mpexp.report.cli import main

sys.exit(main())
