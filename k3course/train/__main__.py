"""``torchrun --nproc-per-node P -m k3course.train --ep P ...``: one expert-parallel rank (:func:`main`)."""

from k3course.train.launch import main

raise SystemExit(main())
