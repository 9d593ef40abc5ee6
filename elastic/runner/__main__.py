import sys

from elastic.runner.cli import main

sys.exit(main())
