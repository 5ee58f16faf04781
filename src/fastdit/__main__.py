"""Allow ``python -m fastdit``, the same as the ``fastdit`` console script."""

from fastdit.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
