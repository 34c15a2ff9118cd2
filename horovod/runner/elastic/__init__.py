"""horovodrun's elastic driver: host discovery, blacklisting, rank assignment and the rounds
of membership that workers join (``horovod.rendezvous.elastic`` is the protocol).

Must not touch: the training runtime (workers learn their ranks through the store).
"""
