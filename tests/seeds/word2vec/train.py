# Seed 000's word2vec cluster job (api_train_v2_cluster.py): paddle.init from the PADDLE_INIT_* variables, the
# dictionary from word_dict.pickle, each trainer its train.list shard, 5-gram model. The v2 network
# (paddle.layer.*) is written with fluid.layers here, as docs/migrating.md says.
import os
import math
import paddle_cluster.compat.paddle as paddle
import paddle_cluster.compat.paddle.fluid as fluid
import mylib

N = 5
EMB = 16
HIDDEN = 32


def main():
    conf = paddle.init(
        use_gpu=False,
        trainer_count=int(os.getenv("PADDLE_INIT_TRAINER_COUNT", "1")),
        port=int(os.getenv("PADDLE_INIT_PORT", "7164")),
        ports_num=int(os.getenv("PADDLE_INIT_PORTS_NUM", "1")),
        ports_num_for_sparse=int(os.getenv("PADDLE_INIT_PORTS_NUM_FOR_SPARSE", "1")),
        num_gradient_servers=int(os.getenv("PADDLE_INIT_NUM_GRADIENT_SERVERS", "1")),
        trainer_id=int(os.getenv("PADDLE_INIT_TRAINER_ID", "0")),
        pservers=os.getenv("PADDLE_INIT_PSERVERS", "127.0.0.1"))
    trainer_id = int(os.getenv("PADDLE_INIT_TRAINER_ID", "0"))
    num_passes = int(os.getenv("PADDLE_INIT_NUM_PASSES", "1"))
    saving_period = int(os.getenv("PADDLE_INIT_SAVING_PERIOD", "1"))
    print("init: trainer_count=%s use_gpu=%s num_passes=%d saving_period=%d node=%d" % (
        conf.flag("trainer_count"), os.getenv("PADDLE_INIT_USE_GPU"), num_passes, saving_period, mylib.node_id()))

    word_dict = mylib.load_dict()
    dict_size = len(word_dict)
    words = [fluid.layers.data(name="w%d" % i, shape=[1], dtype="int64") for i in range(N)]
    embs = [fluid.layers.embedding(input=w, size=[dict_size, EMB], is_sparse=True, param_attr="_proj")
            for w in words[:N - 1]]
    hidden = fluid.layers.fc(input=fluid.layers.concat(input=embs, axis=1), size=HIDDEN, act="sigmoid")
    predict = fluid.layers.fc(input=hidden, size=dict_size, act="softmax")
    avg_cost = fluid.layers.mean(fluid.layers.cross_entropy(input=predict, label=words[N - 1]))
    fluid.optimizer.Adagrad(learning_rate=0.1).minimize(avg_cost)

    t = fluid.DistributeTranspiler()
    t.transpile(trainer_id=trainer_id)
    prog = t.get_trainer_program()
    exe = fluid.Executor(fluid.CPUPlace())
    feeder = fluid.DataFeeder(feed_list=words, place=fluid.CPUPlace())
    exe.run(fluid.default_startup_program())
    train = mylib.ngram_reader(mylib.my_shard(mylib.list_files("train.list"), trainer_id), word_dict, N)
    reader = paddle.batch(paddle.reader.shuffle(train, buf_size=1000), batch_size=64)
    for pass_id in range(num_passes):
        total, count = 0.0, 0
        for batch_id, batch in enumerate(reader()):
            cost, = exe.run(prog, feed=feeder.feed(batch), fetch_list=[avg_cost])
            total, count = total + float(cost[0]) * len(batch), count + len(batch)
            if batch_id % 20 == 0:
                print("Pass %d, Batch %d, Cost %f" % (pass_id, batch_id, float(cost[0])))
        print("Pass %d done, mean cost %f, perplexity %f" % (pass_id, total / count, math.exp(total / count)))
        if trainer_id == 0 and (pass_id + 1) % saving_period == 0:
            fluid.io.save_inference_model("output/pass-%05d" % pass_id, ["w%d" % i for i in range(N - 1)],
                                          [predict], exe)
    exe.close()


if __name__ == "__main__":
    main()
