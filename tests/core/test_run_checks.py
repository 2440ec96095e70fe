"""The launcher's checks of a Task before any worker starts (distrun._cli.run_checks).

A check that refuses a run the workers would accept is worse than none: these cases must pass
through to the workers, and the certain ones must be caught.
"""

from __future__ import annotations

import pytest

from distrun._cli.run_checks import task_lacks

LACKS = {
    "subclass_of_distrun_task": "import distrun\nclass T(distrun.Task):\n    pass\n",
    "imported_task_class": "from distrun import Task as Base\nclass T(Base):\n    pass\n",
    "plain_class": "class T:\n    def training_step(self, model, batch): ...\n",
    "through_a_local_base": "from distrun import Task\nclass B(Task):\n    pass\n"
                            "class T(B):\n    pass\n",
}
UNKNOWN = {  # the workers decide: the method may come from somewhere the launcher cannot see
    "defined": "class T:\n    def test_step(self, model, batch): ...\n",
    "named_anywhere": "class T:\n    pass\nsetattr(T, 'test' + '_step', None)  # test_step\n",
    "base_from_elsewhere": "from mylib import Base\nclass T(Base):\n    pass\n",
    "another_task_class": "from mylib import Task\nclass T(Task):\n    pass\n",
    "decorated": "import functools\n@functools.total_ordering\nclass T:\n    pass\n",
    "metaclass": "class T(metaclass=type):\n    pass\n",
    "getattr": "class T:\n    def __getattr__(self, name): ...\n",
    "not_a_class": "def make(): ...\nT = make()\n",
    "syntax_error": "class T(:\n",
}


@pytest.mark.parametrize("name", list(LACKS))
def test_a_task_certainly_without_the_method_is_named(tmp_path, name):
    (tmp_path / "t.py").write_text(LACKS[name])
    assert task_lacks(f"{tmp_path / 't.py'}:T", "test_step") == "T"


@pytest.mark.parametrize("name", list(UNKNOWN))
def test_a_task_that_may_have_the_method_is_left_to_the_workers(tmp_path, name):
    (tmp_path / "t.py").write_text(UNKNOWN[name])
    assert task_lacks(f"{tmp_path / 't.py'}:T", "test_step") is None


def test_a_module_target_is_found_without_importing_it(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg_for_checks"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (pkg / "tasks.py").write_text(LACKS["subclass_of_distrun_task"])
    monkeypatch.chdir(tmp_path)
    assert task_lacks("pkg_for_checks.tasks:T", "test_step") == "T"
    assert task_lacks("pkg_for_checks.missing:T", "test_step") is None
