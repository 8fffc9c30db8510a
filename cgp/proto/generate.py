"""Regenerate caffe_pb2.py and cgp_pb2.py from caffe.proto and cgp.proto with the protoc bundled in
grpcio-tools.

Run `python -m cgp.proto.generate [OUTDIR]` (default: this folder) after editing a .proto file. Only
developers need it: the *_pb2.py modules are committed, so users need neither protoc nor grpcio-tools.
"""

import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILES = ("caffe.proto", "cgp.proto")


def generate(outdir=PROTO_DIR):
    """Write caffe_pb2.py and cgp_pb2.py into outdir; return their paths."""
    from grpc_tools import protoc  # imported here: a test-only dependency, not needed to use cgp

    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in PROTO_FILES:
        # -I the folder plus the bare file name: the output then names "caffe.proto", not an
        # absolute path, so it is byte-identical wherever the repository lives.
        args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={outdir}", name]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_DIR / name}")
        paths.append(outdir / name.replace(".proto", "_pb2.py"))
    return paths


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 1:
        sys.exit("usage: python -m cgp.proto.generate [OUTDIR]")
    for path in generate(*argv):
        print(path)


if __name__ == "__main__":
    main()
