"""The side-model trainers, on the shared optimizer and schedule (:mod:`train.common`): the audio codec
(:mod:`train.side.audio_codec`), the vision tokenizer (:mod:`train.side.vision_tokenizer`) and the
cascaded refiner (:mod:`train.side.refiner`). Each writes one output folder the backbone's run reads
frozen (``data.audio_codec``, ``data.vision_tokenizer``, ``data.refiner``)."""
