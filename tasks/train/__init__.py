"""The train stage: the run's EAGLE-3 draft (tasks/draft/ holds the model, trainer and export).

stage.py  the one composition every runner calls (`run_train_stage`): the draft, the
          data-scaling drafts when configured, each on the run's store and with its online
          target; then the exports of the best checkpoint
main.py   the stage's training as its own process, one per rank under torchrun
          (`python -m tasks.train.main`)

flows/train.py runs the stage under Prefect (`eaglescale run`, also what gpunode runs on its GPU
node); nothing in tasks/ imports this package.
"""
