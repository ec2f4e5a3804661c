"""What the lessons run: the tasks of chapters 04–06 (decay tasks, associative recall), the residual
comparison of chapter 10, your functions inside the model (``parts``), the per-rank functions of chapter 13
(``ep_workers``), chapter 12's claims and experiments, the diagrams, and the notebook helpers. Import the
modules themselves (``from k3course.lessons import recall``): nothing is loaded here.
"""
