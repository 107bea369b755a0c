"""The test ranks' stand-in for ``torch._dynamo`` (``tests/_site/sitecustomize.py``).

It must change nothing a test checks: the optimizers' arithmetic bit for bit against the real
import, the real module wherever anything beyond the two eager no-ops is asked, nothing at
all without its switch, and no other ``sitecustomize`` hidden.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests._mpi import ROOT, SITE, job_env, ranks_python

# Three steps of SGD (momentum, weight decay) and of Adam on a fixed model; the parameters'
# bytes, and which torch._dynamo the process ended with.
STEPS = """
import hashlib, json, sys, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
digests = {}
for name, make in (("sgd", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9,
                                                   weight_decay=1e-3, nesterov=True)),
                   ("adam", lambda p: torch.optim.Adam(p, lr=0.01))):
    m = __import__("copy").deepcopy(model)
    opt = make(m.parameters())
    for i in range(3):
        opt.zero_grad()
        m(torch.linspace(-1, 1, 10 * (i + 1)).reshape(-1, 5)).pow(2).sum().backward()
        opt.step()
    opt.load_state_dict(opt.state_dict())
    digests[name] = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                            for p in m.parameters())).hexdigest()
standin = getattr(sys.modules["torch._dynamo"], "STANDIN", False)
after = None
if len(sys.argv) > 1:  # ask for something only the real module has
    torch._dynamo.reset()
    import torch._dynamo.utils  # noqa: F401 - a submodule's import
    after = getattr(sys.modules["torch._dynamo"], "STANDIN", False)
print(json.dumps({"digests": digests, "standin": standin, "after": after}))
"""


def _python(code: str, *args: str, env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         timeout=120, env={**os.environ, **env}, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_the_optimizers_arithmetic_is_torchs_own_and_the_rest_gets_the_real_module():
    lean = _python(STEPS, "ask", env={**ranks_python(), "HADPSGD_TEST_DYNAMO_STANDIN": "1"})
    real = _python(STEPS, env={**ranks_python(), "HADPSGD_TEST_DYNAMO_STANDIN": "0"})
    assert lean["standin"] is True and real["standin"] is False
    assert lean["digests"] == real["digests"]
    # Anything beyond disable/graph_break (reset(), a submodule) put the real module in place.
    assert lean["after"] is False


def test_the_ranks_get_it_unless_the_suite_or_the_test_says_real(monkeypatch):
    assert job_env(2)["HADPSGD_TEST_DYNAMO_STANDIN"] == "1"
    assert job_env(2)["PYTHONPATH"].split(os.pathsep)[:2] == [str(SITE), str(ROOT)]
    # An inherited path that holds both already keeps each once.
    again = ranks_python(os.pathsep.join([str(SITE), str(ROOT), "/x"]))["PYTHONPATH"]
    assert again.split(os.pathsep) == [str(SITE), str(ROOT), "/x"]
    monkeypatch.setenv("HADPSGD_TEST_REAL_DYNAMO", "1")
    assert "HADPSGD_TEST_DYNAMO_STANDIN" not in job_env(2)


def test_a_sitecustomize_further_down_the_path_still_runs(tmp_path: Path):
    (tmp_path / "sitecustomize.py").write_text("import builtins\nbuiltins.SEEN_NEXT = True\n")
    env = ranks_python(str(tmp_path))
    out = _python("import json, sys, builtins\n"
                  "print(json.dumps({'torch': 'torch' in sys.modules,\n"
                  "                  'next': getattr(builtins, 'SEEN_NEXT', False)}))",
                  env=env)
    # It ran, and the stand-in's start-up imported nothing (not even torch).
    assert out["next"] is True and out["torch"] is False
