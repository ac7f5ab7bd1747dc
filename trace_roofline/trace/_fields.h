/* Generated from trace_roofline/trace/fields.py by `python -m trace_roofline.trace.fields`:
 * do not edit. Included by _scan.c (after its Field, Kind and RawKey types). */
enum { S_PH, S_CAT, S_NAME, R_DEVICE, R_CPU_OPS, I32_COLUMNS };
enum { F_TS, F_DUR, F64_COLUMNS };
enum { I_PID, I_TID, I_ID, I_ARGS_EXTERNAL_ID, I_ARGS_EXTERNAL_ID_LEGACY, I_ARGS_CORRELATION, I_ARGS_DEVICE, I_ARGS_STREAM, I_ARGS_PYTHON_ID, I_ARGS_PYTHON_PARENT_ID, I64_COLUMNS };
enum { A_ARGS_GRID, A_ARGS_BLOCK, A_ARGS_INPUT_DIMS, A_ARGS_INPUT_DIMS_LEGACY, A_ARGS_INPUT_TYPES, A_ARGS_CONCRETE_INPUTS, A_ARGS_INPUT_STRIDES, RAW_ARGS };
static const char *const I32_NAMES[] = {"ph", "cat", "name", "raw.device", "raw.cpu_ops"};
static const char *const F64_NAMES[] = {"ts", "dur"};
static const char *const I64_NAMES[] = {"pid", "tid", "id", "args.external_id", "args.external_id_legacy", "args.correlation", "args.device", "args.stream", "args.python_id", "args.python_parent_id"};
static Field EVENT_FIELDS[] = {
    {"ph", 2, K_STR, S_PH},
    {"cat", 3, K_STR, S_CAT},
    {"name", 4, K_STR, S_NAME},
    {"pid", 3, K_INT_STR_NULL, I_PID},
    {"tid", 3, K_INT_STR_NULL, I_TID},
    {"ts", 2, K_F64, F_TS},
    {"dur", 3, K_F64, F_DUR},
    {"id", 2, K_INT_STR_NULL, I_ID},
    {"args", 4, K_ARGS, 0},
};
static Field ARGS_FIELDS[] = {
    {"External id", 11, K_INT, I_ARGS_EXTERNAL_ID},
    {"external id", 11, K_INT, I_ARGS_EXTERNAL_ID_LEGACY},
    {"correlation", 11, K_INT, I_ARGS_CORRELATION},
    {"device", 6, K_INT, I_ARGS_DEVICE},
    {"stream", 6, K_INT_STR, I_ARGS_STREAM},
    {"grid", 4, K_RAW, A_ARGS_GRID},
    {"block", 5, K_RAW, A_ARGS_BLOCK},
    {"Input Dims", 10, K_RAW, A_ARGS_INPUT_DIMS},
    {"Input dims", 10, K_RAW, A_ARGS_INPUT_DIMS_LEGACY},
    {"Input type", 10, K_RAW, A_ARGS_INPUT_TYPES},
    {"Concrete Inputs", 15, K_RAW, A_ARGS_CONCRETE_INPUTS},
    {"Input Strides", 13, K_RAW, A_ARGS_INPUT_STRIDES},
    {"Python id", 9, K_INT_NULL, I_ARGS_PYTHON_ID},
    {"Python parent id", 16, K_INT_NULL, I_ARGS_PYTHON_PARENT_ID},
};
static const RawKey RAW_KEYS[] = {
    {R_DEVICE, 2, {A_ARGS_GRID, A_ARGS_BLOCK}},
    {R_CPU_OPS, 5, {A_ARGS_INPUT_DIMS, A_ARGS_INPUT_DIMS_LEGACY, A_ARGS_INPUT_TYPES, A_ARGS_CONCRETE_INPUTS, A_ARGS_INPUT_STRIDES}},
};
