/* Greedy tokens of a GGUF model under llama.cpp, from prompt token ids (no tokenizer in the way),
 * so they can be set against freetoken's greedy tokens for the same prompt ids.
 *
 *   cc -O2 benchmarks/llamacpp_greedy.c -I LLAMA/include -I LLAMA/ggml/include \
 *      -L LLAMA/build/bin -lllama -Wl,-rpath,LLAMA/build/bin -o llamacpp_greedy
 *   llamacpp_greedy MODEL.gguf 1,2,3,... STEPS [THREADS]
 *
 * Prints one JSON line: {"token_ids": [...], "logits": [[...], ...]}, the logits of every step
 * (the step's whole vocabulary row, before its argmax) for a tolerance check beside the tokens.
 * Ties go to the lowest id, as torch.argmax does.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

static void quiet_log(enum ggml_log_level level, const char * text, void * user) {
    (void) user;
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

int main(int argc, char ** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL.gguf ID,ID,... STEPS [THREADS]\n", argv[0]);
        return 2;
    }
    int steps = atoi(argv[3]);
    int threads = argc > 4 ? atoi(argv[4]) : 2;
    int cap = 1;
    for (const char * c = argv[2]; *c; c++) cap += *c == ',';
    llama_token * prompt = malloc(sizeof(llama_token) * cap);
    int n_prompt = 0;
    for (char * tok = strtok(argv[2], ","); tok; tok = strtok(NULL, ",")) prompt[n_prompt++] = atoi(tok);
    if (n_prompt == 0 || steps < 1) {
        fprintf(stderr, "need at least one prompt id and one step\n");
        return 2;
    }

    llama_log_set(quiet_log, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "llama.cpp could not load %s\n", argv[1]);
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_prompt + steps + 8;
    cp.n_batch = n_prompt;
    cp.n_ubatch = n_prompt;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "llama.cpp could not make a context\n");
        return 1;
    }
    int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    printf("{\"token_ids\": [");
    llama_token next = 0;
    struct llama_batch batch = llama_batch_get_one(prompt, n_prompt);
    float ** rows = malloc(sizeof(float *) * steps);
    for (int step = 0; step < steps; step++) {
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "llama_decode failed at step %d\n", step);
            return 1;
        }
        const float * logits = llama_get_logits_ith(ctx, -1);
        rows[step] = malloc(sizeof(float) * n_vocab);
        memcpy(rows[step], logits, sizeof(float) * n_vocab);
        int best = 0;
        for (int i = 1; i < n_vocab; i++) if (logits[i] > logits[best]) best = i;
        next = best;
        printf(step ? ", %d" : "%d", next);
        batch = llama_batch_get_one(&next, 1);
    }
    printf("], \"logits\": [");
    for (int step = 0; step < steps; step++) {
        printf(step ? ", [" : "[");
        for (int i = 0; i < n_vocab; i++) printf(i ? ", %.9g" : "%.9g", rows[step][i]);
        printf("]");
    }
    printf("]}\n");
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
