import sys

from autoflash.bench import main

sys.exit(main())
