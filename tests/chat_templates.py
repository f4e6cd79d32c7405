"""Chat templates in the shape of Qwen's, for the offline test tokenizer.

KEEP_THINKING renders every assistant turn's reasoning (append-only across turns).
DROP_OLD_THINKING renders reasoning only after the last user query, as Qwen3's template does,
so a new user turn rewrites history: the case token drift checks must catch.
"""

_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}
{%- for message in messages %}
  {%- if message.role == 'system' and loop.first %}
  {%- elif message.role == 'user' or message.role == 'system' %}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
  {%- elif message.role == 'assistant' %}
    {%- set content = message.content or '' %}
    {{- '<|im_start|>assistant\n' }}
    {%- if message.reasoning_content and KEEP_CONDITION %}
      {{- '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' }}
    {%- endif %}
    {{- content }}
    {%- for tool_call in message.tool_calls or [] %}
      {%- if content or not loop.first %}{{- '\n' }}{%- endif %}
      {%- set fn = tool_call.function %}
      {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
      {%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
      {{- '}\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\n' }}
  {%- elif message.role == 'tool' %}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
    {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

KEEP_THINKING = _TEMPLATE.replace("KEEP_CONDITION", "true").strip()
DROP_OLD_THINKING = _TEMPLATE.replace("KEEP_CONDITION", "loop.index0 > ns.last_query").strip()
