"""`trl-grpo-ext report` (`command`) and `report.png` (`figure`): one verdict per signal of a run's log history
(`health`), written as text, markdown or JSON (`formats`), read from a trainer state or TensorBoard event files
(`tensorboard`); the generation lost to groups without reward spread (`sampling`)."""
