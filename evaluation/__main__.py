"""``python -m evaluation``: the same as ``python -m evaluation.bench``."""

from evaluation.bench import main

raise SystemExit(main())
