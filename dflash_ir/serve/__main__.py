"""`python -m dflash_ir.serve` = `dflash-serve`."""
import sys

from .cli import main

sys.exit(main())
