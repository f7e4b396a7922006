"""No domain may run as the unprivileged supervisor's user (red team round 4: under
`run --privsep` on a machine without trio-supervisor the supervisor proper is nobody,
and `[domains.X] user = "nobody"` loaded: its sandboxes shared the supervisor's uid)."""
from __future__ import annotations

import pytest

from supervisor.config import ConfigError, loads
from supervisor.config._rules import SUPERVISOR_USERS
from supervisor.lifecycle._privsep import NOBODY, PROPER_USER

_CFG = '''
[domains.d]
profile = "{profile}"
user = "{user}"
[workers.w]
domain = "d"
module = "workers.probe"
'''


def test_the_rule_knows_the_users_privsep_drops_to():
    assert PROPER_USER in SUPERVISOR_USERS and SUPERVISOR_USERS["nobody"] == NOBODY


@pytest.mark.parametrize("profile", ["control", "research"])
@pytest.mark.parametrize("user", ["nobody", "trio-supervisor"])
def test_no_domain_runs_as_the_supervisor_propers_user(profile, user):
    with pytest.raises(ConfigError) as e:
        loads(_CFG.format(profile=profile, user=user), "users.toml")
    msg = str(e.value)
    assert "domains.d.user" in msg and "unprivileged supervisor" in msg, msg
    assert "\n" not in msg.strip() or msg.count("domains.d.user") == 1, msg
