"""Face and person re-identification training with sharded margin-softmax heads."""
