"""Keras code shared by ``horovod.tensorflow.keras`` (tf.keras, Keras 2 or 3) and
``horovod.keras`` (standalone Keras 3 on any backend).

It imports no Keras itself: each frontend hands it its own Keras classes (``Callback``,
``ModelCheckpoint``) and its variable broadcast, so ``horovod.keras`` never imports TensorFlow
and ``horovod.tensorflow.keras`` never imports standalone Keras.

Must not touch: a Keras module of its own choosing, the engine (it uses ``horovod.frontend``).
"""
