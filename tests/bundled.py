"""The bundled models' solvers for tests: net paths made absolute, fields overridden."""
from cgp import models
from cgp.prototxt import read_solver


def solver(name, **fields):
    """A bundled solver (mnist, cifar10, ...) with its net path made absolute and `fields`
    set (a list replaces a repeated field)."""
    sp = read_solver(models.solver_path(name))
    sp.net = str(models.FOLDER / sp.net)
    for key, value in fields.items():
        if isinstance(value, list):
            del getattr(sp, key)[:]
            getattr(sp, key).extend(value)
        else:
            setattr(sp, key, value)
    return sp
