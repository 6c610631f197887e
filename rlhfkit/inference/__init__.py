"""Generation outside training, the services of the inference commands (cli/ turns their flags into these):

    chat.py     a conversation with a model, turn by turn (interactive_chat, `rlhfkit chat`)
"""
