"""Regenerate caffe_pb2.py from caffe.proto with the protoc bundled in grpcio-tools.

Run `python -m cgp.proto.generate [OUTDIR]` (default: this folder) after editing caffe.proto. Only
developers need it: caffe_pb2.py is committed, so users need neither protoc nor grpcio-tools.
"""

import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILE = "caffe.proto"


def generate(outdir=PROTO_DIR):
    """Write caffe_pb2.py into outdir; return its path."""
    from grpc_tools import protoc  # imported here: a test-only dependency, not needed to use cgp

    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    # -I the folder plus the bare file name: the output then names "caffe.proto", not an absolute
    # path, so it is byte-identical wherever the repository lives.
    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={outdir}", PROTO_FILE]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_DIR / PROTO_FILE}")
    return outdir / "caffe_pb2.py"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 1:
        sys.exit("usage: python -m cgp.proto.generate [OUTDIR]")
    print(generate(*argv))


if __name__ == "__main__":
    main()
