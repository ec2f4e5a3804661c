"""``torchrun --nproc-per-node P -m k3course.train --ep P ...``: one expert-parallel rank (:func:`main`)."""

from k3course.train.launch import main

if __name__ == "__main__":
    raise SystemExit(main())
