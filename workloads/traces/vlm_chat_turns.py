"""What vlm-chat's users say around a question: the system prompt, each user's preamble and the follow-ups. The model
workload (``workloads.models.vlm_chat``, and ``vlm_mstar`` and ``video_chat`` after it) and its replica-replay trace
(``image_chats``) both lay out their sessions from these."""

SYSTEM = ("You are a careful assistant. You answer questions about the images the user shows, citing what you see "
          "in them, and you give the letter of the option you choose.")
PREAMBLES = ("Answer with the letter of the correct option.",
             "Think step by step about the figure, then give the letter of your answer.",
             "I am studying for an exam. Explain briefly and give the answer.")
FOLLOW_UPS = ("Why is that option correct? Point to the part of the image that shows it.",
              "Which other option is the most tempting distractor, and why is it wrong?")
