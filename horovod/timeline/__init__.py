"""Reading Horovod timelines: ``python -m horovod.timeline summary timeline.json`` prints where
the time went per tensor and per rank, and plots it. (The timeline itself is written by the
runtime, ``horovod/core/timeline.py``.)

Must not touch: the runtime (it reads timeline files after the fact).
"""

from horovod.timeline.summary import Summary, load, summarize

__all__ = ["Summary", "load", "summarize"]
