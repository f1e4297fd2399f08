import sys

from specdec.native import main

sys.exit(main())
