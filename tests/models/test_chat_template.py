"""Chat templates render as transformers renders them: jinja2's immutable sandbox, trim_blocks and lstrip_blocks,
and the helpers templates call (raise_exception, tojson); unsafe or broken templates are clear errors."""

import pytest

from rocketkv_jax.models.tokenizer import ChatTemplateError, render_chat_template

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_blocks_are_trimmed_like_transformers():
  tpl = ("{% for m in messages %}\n"
         "    {% if m.role == 'system' %}\n"
         "<<SYS>>{{ m.content }}<</SYS>>\n"
         "    {% else %}\n"
         "[{{ m.role }}] {{ m.content }}\n"
         "    {% endif %}\n"
         "{% endfor %}\n"
         "{% if add_generation_prompt %}[assistant] {% endif %}")
  assert render_chat_template(tpl, MSGS, add_generation_prompt=True) == \
      "<<SYS>>Be brief.<</SYS>>\n[user] Hi\n[assistant] "


def test_helpers_and_errors():
  assert render_chat_template("{{ messages[1] | tojson }}", MSGS) == '{"role": "user", "content": "Hi"}'
  strict = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
  with pytest.raises(ChatTemplateError, match="refused the messages: first message must be from the user"):
    render_chat_template(strict, MSGS)
  with pytest.raises(ChatTemplateError, match="does not parse"):
    render_chat_template("{% for m in messages %}", MSGS)
  # the sandbox: no reaching into Python objects, no changing the caller's messages
  with pytest.raises(ChatTemplateError, match="SecurityError"):
    render_chat_template("{{ messages.__class__.__mro__ }}", MSGS)
  with pytest.raises(ChatTemplateError, match="SecurityError"):
    render_chat_template("{{ messages.append(1) }}", MSGS)
  assert len(MSGS) == 2


def test_template_found_where_transformers_looks(tmp_path):
  """chat_template.jinja wins over chat_template.json, which wins over tokenizer_config.json's own."""
  from rocketkv_jax.models.tokenizer import chat_template_of
  cfg = {"chat_template": "from tokenizer_config"}
  assert chat_template_of(str(tmp_path), cfg) == "from tokenizer_config"
  assert chat_template_of(str(tmp_path), {"chat_template": [{"name": "tool", "template": "t"},
                                                            {"name": "default", "template": "d"}]}) == "d"
  (tmp_path / "chat_template.json").write_text('{"chat_template": "from json"}')
  assert chat_template_of(str(tmp_path), cfg) == "from json"
  (tmp_path / "chat_template.jinja").write_text("{{ 'from jinja' }}\n")
  assert chat_template_of(str(tmp_path), cfg) == "{{ 'from jinja' }}\n"
  assert chat_template_of(str(tmp_path), {}) == "{{ 'from jinja' }}\n"
