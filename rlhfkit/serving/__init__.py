"""The reward-model server's services (`rlhfkit.cli.serve_rm` is the command that runs them):

    request.py   HTTP/1.1 request reading under limits (header and body timeouts, sizes), JSON
                 parsing, and the one-line JSON errors a client gets back
    batcher.py   FairBatcher: requests of many clients into forward-pass batches, fair across
                 clients, with a bounded queue (a full queue answers 503)
    scorer.py    ServeConfig (the server's settings) and RewardScorer (tokenizer + reward model, one padded
                 forward per micro-batch)
    app.py       create_app (the FastAPI app: intake, batcher, answers), malloc arena and heap trimming,
                 the torch thread count, the bound socket
"""
