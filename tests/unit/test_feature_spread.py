"""`benchmarks/feature_spread.py` (issue 42's measure): the code lines naming a feature outside its folder, and how
many of them are where the issue allows a feature to appear."""

from __future__ import annotations

from benchmarks.feature_spread import feature_spread


def test_feature_spread_counts_code_lines_outside_the_folder_and_those_where_the_issue_allows_them(tmp_path):
    """A line naming a feature counts outside its folder only (comments and docstrings never); of those, the ones in
    `parallel_dims.py`, a strategy's constructor, `PlanOptions`, an `add_argument` or `STEPS` are its mesh dim,
    options or step."""
    files = {
        "float8/step.py": "def convert():\n    return 'float8'\n",  # its own folder: not counted
        "parallel_dims.py": "float8_mesh = None\n",
        "strategies/s.py": (
            "class S:\n"
            "    def __init__(self, float8=None):\n"
            "        '''float8: a docstring is no code'''\n"
            "        self.float8 = float8\n"
            "    def step(self):\n"
            "        return self.float8  # a comment naming float8\n"
        ),
        "plan/options.py": "class PlanOptions:\n    float8: object = None\n",
        "cli.py": "def parse(parser):\n    parser.add_argument(\n        '--float8',\n    )\n",
        "parallel/walk.py": "STEPS = (\n    'float8',\n)\nFLOAT8_RATE = 1\n",
    }
    for name, source in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(source)
    (spread,) = [s for s in feature_spread(tmp_path) if s.feature == "float8"]
    assert spread.files == {
        "parallel_dims.py": 1,
        "strategies/s.py": 3,
        "plan/options.py": 1,
        "cli.py": 1,
        "parallel/walk.py": 2,
    }
    # Allowed: parallel_dims (1), the constructor's two lines, PlanOptions (1), add_argument (1), STEPS (1);
    # elsewhere: `step` reading it (1) and the module constant (1).
    assert spread.allowed == 6
    assert spread.lines - spread.allowed == 2
