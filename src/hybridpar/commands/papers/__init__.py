"""The papers' own figures and models, reproduced for the commands that show them: Dettmers' speed-up
model (`plan --model-of dettmers`), Krizhevsky's hand-off sweep and `simulate`, and the codecs'
Table 2 (`codecs`). The planner and the runtime import nothing from here."""
