"""Bundled network and solver prototxt files (installed as cgp.models), and the short
names the command line accepts for them."""
from pathlib import Path

from cgp.errors import CgpError

FOLDER = Path(__file__).parent
SHORT_NAMES = {
    "mnist": "lenet_solver.prototxt",
    "lenet": "lenet_solver.prototxt",
    "cifar10": "cifar10_quick_solver.prototxt",
    "cifar10_quick": "cifar10_quick_solver.prototxt",
    "cifar10_full": "cifar10_full_solver.prototxt",
    "resnet20": "resnet20_cifar10_solver.prototxt",
}


def solver_path(name):
    """The bundled solver file for a short name."""
    if name not in SHORT_NAMES:
        raise CgpError(f"unknown model '{name}': known are {', '.join(SHORT_NAMES)} "
                       "(or give --solver path/to/solver.prototxt)")
    return FOLDER / SHORT_NAMES[name]
