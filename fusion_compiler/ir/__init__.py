"""The intermediate representation every stage shares: the canonical op set (:mod:`.ops`), the
fused region (:mod:`.region`) and the package's exceptions (:mod:`.errors`)."""
