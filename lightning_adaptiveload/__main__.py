import sys

from lightning_adaptiveload.cli import main

sys.exit(main())
