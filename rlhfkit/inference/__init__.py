"""Generation outside training, the services of the inference commands (cli/ turns their flags into these):

    chat.py      a conversation with a model, turn by turn (interactive_chat, `rlhfkit chat`)
    generate.py  best-of-n generation of prompt rows (batch_inference --eval_task generate)
    score.py     reward-model scores of (input, output) rows, formatted as train_rm's data (--eval_task rm)
"""
