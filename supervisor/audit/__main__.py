"""``python -m supervisor.audit ...``: the same as ``supervisor audit ...``."""
import sys

from supervisor import signals as _signals

_signals.install()

from supervisor.audit.command import main  # noqa: E402

sys.exit(main())
