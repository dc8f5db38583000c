"""The README's contract: two set-up commands first, .ci/run runs the second, every config key documented."""

from pathlib import Path

from revffn.methods import METHODS
from revffn.training.config import SCHEMA

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_readme_opens_with_two_commands_and_ci_runs_the_test_one():
    block = README.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert len(block) == 2
    assert block[0].endswith("revffn train")
    assert "pytest" in block[1]
    assert block[1] in (ROOT / ".ci" / "run").read_text()


def test_every_config_key_is_documented():
    for key in SCHEMA:
        assert f"`{key}`" in README, key
    for name, method in METHODS.items():
        assert f"`{name}`" in README
        for key in method.SCHEMA:
            assert f"`{name}.{key}`" in README, f"{name}.{key}"
