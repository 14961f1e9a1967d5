"""Child side of tests/helpers/world.py: import FILE by path, call FUNC(rank, size, *args)."""

import importlib.util
import os
import pickle
import sys


def main() -> None:
    file, func, argfile, out = sys.argv[1:5]
    spec = importlib.util.spec_from_file_location("_hora_world_test_module", file)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    with open(argfile, "rb") as f:
        args = pickle.load(f)
    result = getattr(mod, func)(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), *args)
    with open(out, "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    main()
