"""The app: the ``smx`` command line (:mod:`.cli`), the demo (:mod:`.demo`), language-model checkpoints,
their evaluation and the calibration of swapped variants (:mod:`.lm`), and ``argparse`` types shared with
the benchmark scripts (:mod:`.argtypes`). It is built on the library; the library never imports it.
"""
