"""The README's custom training loop runs as written."""

import os
import re

import numpy as np

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def test_readme_training_loop_example_runs():
  code = re.findall(r"```python\n(.*?)```", open(README).read(), re.S)
  assert code, "README lost its python example"
  namespace = {}
  exec(compile(code[0], "README.md", "exec"), namespace)
  value, dh = namespace["value"], namespace["dh"]
  assert np.isfinite(float(value)) and dh.shape == (64, 128)
  assert float(value) < np.log(512)  # 10 steps on one batch: below the uniform loss over the active set
