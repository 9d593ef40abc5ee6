import sys

from elastic.ctl.cli import main

sys.exit(main())
